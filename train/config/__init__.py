"""The run config: one YAML file, its sections, TRL's training fields, the checks before a run."""
