// Validates Gateway API objects (JSON array in argv[2]) against the schemas that
// @kubernetes-models/gateway-api generates from the Gateway API CRDs. Prints one line per
// object; exits 1 if any is invalid.
import { readFileSync } from "node:fs";
import { Gateway } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/Gateway";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";

const kinds = {
  "gateway.networking.k8s.io/v1/Gateway": Gateway,
  "gateway.networking.k8s.io/v1/HTTPRoute": HTTPRoute,
};
const docs = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const { source, object } of docs) {
  const key = `${object.apiVersion}/${object.kind}`;
  const Model = kinds[key];
  if (!Model) {
    console.log(`FAIL ${source}: no schema for ${key}`);
    failed++;
    continue;
  }
  try {
    new Model(object).validate();
    console.log(`ok   ${source}: ${key} ${object.metadata?.name}`);
  } catch (e) {
    console.log(`FAIL ${source}: ${key}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
