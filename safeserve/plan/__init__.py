"""`safeserve plan`: size an MoE deployment from the bytes a decode step reads.

`model.py` weighs a model from its config (what each rank holds under a layout), `gpus.py` and
`gpus.toml` hold the GPUs' data and calibration, `arithmetic.py` the formulas (experts a batch
reads, all-to-all traffic, the calibrated step time), `planner.py` sizes every layout as the
ranks would and picks one, `report.py` prints it, `cli.py` is the command.
"""
