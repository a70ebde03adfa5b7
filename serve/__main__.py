"""`python -m serve ARTIFACT [...]`: the OpenAI-compatible server (serve/app.py)."""

from serve.app import main

raise SystemExit(main())
