"""The SDK's asyncio shells: the I/O around the pure core (`cv_workspace_client._core`).

- `pump`: feeds the op machine and carries out what it says (sends, outbox writes, answers).
- `socket` (with `frames`): the websocket a client sends ops and subscribes over.
- `http`: the HTTP routes the SDK calls, and what their answers mean.
- `auth`: where a request's bearer token comes from (a fixed token or a provider).
- `status`: what a client tells the app about its unsynced changes.
- `reads`: state and log reads, retried.
- `retry`: tenacity's full-jitter wait and the retry rule wired together.
"""
