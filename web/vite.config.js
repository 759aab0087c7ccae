// The dashboard is built into the collector's package, which serves it at / (stepwatch_server/web/pages.py).
import { fileURLToPath } from "node:url";
import { defineConfig } from "vite";

export default defineConfig({
  base: "/",
  build: {
    outDir: fileURLToPath(new URL("../service/src/stepwatch_server/web/static", import.meta.url)),
    emptyOutDir: true,
    assetsDir: "assets",
    sourcemap: false,
    // Swagger UI (the API docs page, docs.html) is ~1.5 MB; the dashboard's own scripts stay small.
    chunkSizeWarningLimit: 2000,
    rollupOptions: {
      input: {
        main: fileURLToPath(new URL("index.html", import.meta.url)),
        docs: fileURLToPath(new URL("docs.html", import.meta.url)),
      },
    },
  },
  server: {
    // `npm run dev`: the page from Vite, the API from a collector on :8000.
    proxy: { "/api": "http://127.0.0.1:8000", "/docs": "http://127.0.0.1:8000" },
  },
});
