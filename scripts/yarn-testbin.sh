#!/bin/sh
# The Hadoop YARN jars of the YARN tier (tests/yarn): a ResourceManager, a
# NodeManager, the YARN client and the distributed-shell application, resolved
# with Maven from Maven Central (scripts/yarn/pom.xml lists them) into a cache
# outside the repository. A second run returns at once.
#
#   HADOOP_VERSION=3.4.3 TIDAL_YARN_TESTBIN=DIR sh scripts/yarn-testbin.sh
#
# Prints nothing but progress; the tier finds the jars in $DEST/lib.
set -eu
cd "$(dirname "$0")/.."
HADOOP_VERSION="${HADOOP_VERSION:-3.4.3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tidal"
DEST="${TIDAL_YARN_TESTBIN:-$CACHE/yarn/hadoop-$HADOOP_VERSION}"
if [ -f "$DEST/done" ]; then
    echo "yarn-testbin: cached in $DEST"
    exit 0
fi
command -v mvn >/dev/null 2>&1 || { echo "yarn-testbin: needs Maven (Debian: apt-get install maven)" >&2; exit 1; }
command -v java >/dev/null 2>&1 || { echo "yarn-testbin: needs Java 17 (Debian: openjdk-17-jre-headless)" >&2; exit 1; }
echo "yarn-testbin: resolving Hadoop $HADOOP_VERSION's YARN jars from Maven Central into $DEST"
rm -rf "$DEST"
mkdir -p "$DEST"
# the jars' own local repository beside them (the user's ~/.m2 stays untouched)
mvn --batch-mode --quiet -f scripts/yarn/pom.xml -Dhadoop.version="$HADOOP_VERSION" \
    -Dmaven.repo.local="$CACHE/yarn/m2" \
    org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$DEST/lib"
count="$(ls "$DEST/lib" | wc -l)"
[ "$count" -gt 50 ] || { echo "yarn-testbin: only $count jars resolved" >&2; exit 1; }
echo "$HADOOP_VERSION" > "$DEST/done"
echo "yarn-testbin: $count jars, $(du -sh "$DEST/lib" | cut -f1)"
