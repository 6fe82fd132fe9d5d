"""worker bootstrap: where am I (env), signals -> stop flag, and main.py, the one place that wires
every stage together. May import any stage (main.py wires them); env.py, codes.py and signals' flag
stay small."""
