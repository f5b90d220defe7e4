"""The model zoo.  Importing this package loads no torch; ``models.zoo`` does."""
