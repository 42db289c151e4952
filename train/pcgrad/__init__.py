"""PCGrad between the accuracy and reasoning objectives: the maths, the gradients, the trainer."""
