"""Planning past the machines at hand: a step-time profile of an engine on its hardware, a discrete-event
simulator of a cluster of such engines behind the router, and the search over P:D splits built on it."""
