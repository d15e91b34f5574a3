"""The SDK's fakes, private: `cv_workspace_client.testing` re-exports them for apps' tests.

- `provider`: `CountingFakeProvider`, a provider that counts its calls (`cv-worker --provider
  fake`).
- `proxy`: `FaultProxy` (with `CutRule`, `ProxyStats`), a loopback TCP proxy that breaks
  connections on demand (the flaky network of `cv_workspace_client.stages.demo`).

They live here, not in `testing`, because the commands and the demo use them too, and no module
the product runs imports `testing`: the import contract "production never imports the test
helpers" (pyproject.toml) fails the build if one does.
"""
