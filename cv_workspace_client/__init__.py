"""cv_workspace_client: the retry-safe SDK apps install (DESIGN §6)."""

__all__: list[str] = []
