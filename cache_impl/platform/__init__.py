"""Memory and threads under everything else: aligned and huge-page buffers, OpenMP and thread pools, glibc's heap."""
