# The stepwatch collector image (used by docker-compose.yml).

# The dashboard, built from web/ (pinned by its package-lock.json) into the collector's package.
FROM node:20-slim AS web
WORKDIR /src/web
COPY web/package.json web/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY web/index.html web/vite.config.js ./
COPY web/src src
RUN npm run build

FROM python:3.11-slim
WORKDIR /app
COPY requirements/service.txt requirements/service.txt
RUN pip install --no-cache-dir -r requirements/service.txt
COPY service service
COPY --from=web /src/service/src/stepwatch_server/web/static service/src/stepwatch_server/web/static
COPY migrations migrations
COPY README.md README.md
RUN pip install --no-cache-dir --no-deps ./service
EXPOSE 8000
ENTRYPOINT ["stepwatch-server"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
# The generated dashboards, for `stepwatch-server grafana push --url ... --dashboards /app/dashboards`.
COPY dashboards dashboards
