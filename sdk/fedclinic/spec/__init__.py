"""What a task is and what it produced: the task definition, which tensors it trains and sends, and the
model card. No torch: the aggregator imports this package.
"""
