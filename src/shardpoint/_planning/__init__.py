"""Pure planning: which tensor goes to which file. No I/O, no processes."""
