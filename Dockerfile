# kv-picker service image (the Helm chart's default image): the service only. setup.py builds
# kv_picker from picker/ and scorers/; without benchmarks/ in the build context the wheel has
# no benchmark package and `kv-picker` no benchmark commands.
#   docker build -t kv-picker .
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY picker ./picker
COPY scorers ./scorers
RUN pip install --no-cache-dir . && rm -rf /src && useradd --uid 65532 --no-create-home picker
WORKDIR /
USER 65532
EXPOSE 9002 9090
ENTRYPOINT ["kv-picker"]
CMD ["serve"]
