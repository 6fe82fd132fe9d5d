"""python -m dtk.bench: measured scaling over local workers or the lab (scaling), and the
matmul speed of this machine's devices (matmul, matmul.py), which the planner's step-time
model reads. May import any stage (it runs jobs and reads their runs); no stage imports it.
"""
