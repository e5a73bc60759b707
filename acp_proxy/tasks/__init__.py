"""Prompt turns as durable tasks: their rows, and the book that opens, follows and settles them."""
