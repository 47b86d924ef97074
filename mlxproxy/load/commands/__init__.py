"""The commands `replay`, `bench`, `report` and `demo`: what they send, with which shape, and how they group and show it."""
