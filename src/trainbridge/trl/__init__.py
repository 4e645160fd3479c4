"""trl's trainers on trainbridge's loop: preference losses, packed log-probs, trl configs."""
