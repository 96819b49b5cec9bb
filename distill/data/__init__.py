"""What a draft trains on: the target's responses to the traffic with its top-k teacher (generated here, by inference
servers, or recorded replies), conversations' turns, the feature draft's inputs, on-policy continuations and the
batches, put together for a job by `prepare.prepare_data`. Apart from the training itself, which only reads them."""
