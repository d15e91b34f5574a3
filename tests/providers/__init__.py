"""Provider tests: the HTTP provider against a local fake endpoint, and the counting fake."""
