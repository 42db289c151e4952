"""GRPO training: config, data, models, the TRL trainer subclass, PCGrad, checkpoints."""
