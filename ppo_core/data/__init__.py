"""What goes into a pass: prompt files and the row stream, the built-in tasks, packed micro-batches."""
