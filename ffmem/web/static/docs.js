// The API docs (/docs, templates/docs.html): the vendored Swagger UI over this app's OpenAPI document.
// A file, not an inline script, so the Content-Security-Policy needs no exception (ffmem/web/security.py).
window.ui = SwaggerUIBundle({
  url: document.getElementById("swagger-ui").dataset.openapi,
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  presets: [SwaggerUIBundle.presets.apis],
  deepLinking: true,
  validatorUrl: null, // no badge fetched from validator.swagger.io
});
