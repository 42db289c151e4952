"""Memory per GPU predicted from a model's sizes: ``--check``'s plan and the paper's setup."""
