"""Experiment configs: one file each, ``get_config()`` returns a locked ConfigDict."""
