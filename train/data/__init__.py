"""Training data: rows read from files, checked, turned into prompts and the splits a run uses."""
