"""worker bootstrap: where am I (env), signals -> stop flag, and main.py, the one place that wires
every stage together. main.py may import any stage; env.py, codes.py and signals' flag stay small."""
