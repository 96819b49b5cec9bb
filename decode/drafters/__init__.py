"""What proposes draft tokens: a draft model, prompt lookup, suffix decoding, in chains and trees."""
