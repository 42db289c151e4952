"""CrystalGRPOTrainer: TRL's GRPOTrainer with this project's hooks, each a call on an object of its own."""


def __getattr__(name: str):
    """``from crystal_grpo.train.trainer import CrystalGRPOTrainer``, the drop-in for TRL's trainer,
    without importing TRL for the light modules beside it (interrupt, prompt_order, ...)."""
    if name == "CrystalGRPOTrainer":
        from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

        return CrystalGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
