"""The SDK's side of the work queue (docs/queue.md).

- `requester`: what an app does with requests (enqueue, read, wait, list, cancel, replay).
- `holder`: what a worker does with the requests it holds (claim, heartbeat, complete, fail).
- `transport`: the one retried HTTP call both go through.
"""
