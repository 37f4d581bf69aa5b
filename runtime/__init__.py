"""kubeps runtime: TensorFlow-style parameter-server training without TensorFlow."""
