// The page (placeholder until the UI lands).
