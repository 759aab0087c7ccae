"""The built-in web dashboard: its built files (static/, from the top-level web/ project) and the
event stream that keeps it live."""
