# kv-picker service image (the Helm chart's default image). Builds from this repository:
#   docker build -t kv-picker .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY picker ./picker
COPY scorers ./scorers
COPY benchmarks ./benchmarks
RUN pip install --no-cache-dir . && useradd --uid 65532 --no-create-home picker
USER 65532
EXPOSE 9002 9090
ENTRYPOINT ["kv-picker"]
CMD ["serve"]
