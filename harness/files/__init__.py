"""Reading and writing parity's files: JSON and TOML readers whose errors name the file and key, atomic writes."""
