"""What every step shares: languages and language ID, the harmony format, response parsing,
typed configs, atomic files, HF model loading, seeds and sampling, MLflow tracking, S3."""
