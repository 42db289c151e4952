"""The model organism: a task with reference steps, its tiny policy, and measurements on it."""
