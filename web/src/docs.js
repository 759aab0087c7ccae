// The API docs at /docs: Swagger UI from the pinned npm package, built with the dashboard and served by
// the collector, reading the collector's own /openapi.json. Nothing comes from a CDN (clusters are offline).
import SwaggerUIBundle from "swagger-ui-dist/swagger-ui-bundle.js";
import "swagger-ui-dist/swagger-ui.css";

SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  docExpansion: "list",
  defaultModelsExpandDepth: 0,
  tryItOutEnabled: false,
});
