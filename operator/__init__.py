"""kubeps operator: reconciles PSTrainingJob resources into pods and Services."""
