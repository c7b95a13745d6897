"""Checkpoints that survive: orbax saves and restores onto any mesh (:mod:`dtx.ckpt.checkpoint`),
verified by manifests (:mod:`dtx.ckpt.integrity`), and SIGTERM turned into a save (:mod:`dtx.ckpt.preemption`)."""

from dtx.ckpt import checkpoint, integrity, preemption  # noqa: F401
