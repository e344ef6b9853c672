"""``ciera aot``: the train step compiled for GPUs that are not there, and its report.

compile.py   compiling the step for a target GPU, repeated at each rung vector
schedule.py  reading the scheduled HLO: kernels, conditionals, overlap
"""
