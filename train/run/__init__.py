"""A run folder: its layout, lock and record, complete checkpoints, summary, plot and model card."""
