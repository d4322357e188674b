"""State recurrences shared by both gate shapes (GDN: scalar; GDN2/KDA: per key channel)."""
