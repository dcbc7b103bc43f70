"""`infinity finetune`: model loading, the training loop, reporting, Ctrl-C handling."""
