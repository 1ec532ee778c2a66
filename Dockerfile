# The gateway alone (no engine): point it at your vLLM servers and a database.
#   docker build -t rl-gateway .
#   docker run -p 8100:8100 -e GATEWAY_BACKEND=http://vllm:8000 -e GATEWAY_DB=postgresql://... rl-gateway
# The image holds the wheel built from the sources, installed as a user installs it (never the source tree):
# tests/test_install.py runs this install step in a clean environment and checks the sources copied here.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY gateway ./gateway
COPY rollout_store ./rollout_store
COPY trainer_client ./trainer_client
COPY training_data ./training_data
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --no-deps --wheel-dir dist .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    GATEWAY_HOST=0.0.0.0 GATEWAY_PORT=8100 GATEWAY_DB=sqlite:////data/gateway.db
WORKDIR /app
COPY requirements/constraints.txt requirements/
COPY --from=wheel /src/dist dist/
RUN pip install --no-cache-dir "$(echo dist/*.whl)[server,postgres]" -c requirements/constraints.txt \
    && useradd --create-home gateway && mkdir /data && chown gateway /data
USER gateway
VOLUME /data
EXPOSE 8100
# Liveness on the port the gateway listens on (the shell reads GATEWAY_PORT when the check runs, `docker run
# -e GATEWAY_PORT=...` included); readiness is GET /readyz, for a load balancer (docs/deployment/).
HEALTHCHECK --interval=10s --timeout=3s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${GATEWAY_PORT:-8100}/healthz')"
ENTRYPOINT ["gateway"]
CMD ["serve"]
