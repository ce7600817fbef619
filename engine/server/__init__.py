"""An OpenAI-compatible HTTP server on the kvledger engine (`kvledger serve`) and an online benchmark."""
