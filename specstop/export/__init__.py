"""export: self-describing predictor packages, the dependency-light runtime and the decoder."""
