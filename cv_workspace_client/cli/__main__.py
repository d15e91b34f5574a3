"""`python -m cv_workspace_client.cli worker|workspace ARGS`."""

from cv_workspace_client.cli.workspace import main

raise SystemExit(main())
