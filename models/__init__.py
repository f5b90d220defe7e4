"""ONNX training artifacts (``models.export``) for the zoo's models, which live with the
trainers (``edge_client/trainers/zoo.py``).  Importing this package loads no torch."""
