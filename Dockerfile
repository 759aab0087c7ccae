# The stepwatch collector image (used by docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY requirements/service.txt requirements/service.txt
RUN pip install --no-cache-dir -r requirements/service.txt
COPY service service
COPY migrations migrations
COPY README.md README.md
RUN pip install --no-cache-dir --no-deps ./service
EXPOSE 8000
ENTRYPOINT ["stepwatch-server"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
# The generated dashboards, for `stepwatch-server grafana push --url ... --dashboards /app/dashboards`.
COPY dashboards dashboards
