"""The commands (cli, bench, simulate, launch, plots): tools that stand on the library, off its floor."""
