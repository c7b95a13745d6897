"""One run, top to bottom: :func:`dtx.run.trainer.train` and what it stands on — the set-up
(:mod:`dtx.run.setup`), the run directory (:mod:`dtx.run.rundir`), records (:mod:`dtx.run.metrics`,
:mod:`dtx.run.steplog`), checks before compiling (:mod:`dtx.run.preflight`), the watchdog, evaluation
and export (:mod:`dtx.run.evaluate`) and plans checked against compiled programs (:mod:`dtx.run.verify`)."""
